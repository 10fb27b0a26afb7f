from calendarx.years import days_in_february, is_leap
